#!/bin/sh
# callgraph.sh -- the calls between the files of src/ go one way, down the
# layers, with no circle (scripts/callgraph.sh --check, which lists the
# layers).  Skips (77) where cflow is not installed.
exec "${top_srcdir:-.}/scripts/callgraph.sh" --check
