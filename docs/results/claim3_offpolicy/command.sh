#!/usr/bin/env bash
# Regenerates docs/results/claim3_offpolicy (docs/reproduce.md): its runs on seeds 0-2 and the report.
source "$(dirname "$0")/../args.sh"
takes_no_arguments "$@"
exec "$(dirname "$0")/../claims.sh" claim3_offpolicy
