#!/usr/bin/env bash
# Regenerates docs/results/claim1_fig3 (docs/reproduce.md): its runs on seeds 0-2 and the report.
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
exec "$(dirname "$0")/../claims.sh" claim1_fig3
