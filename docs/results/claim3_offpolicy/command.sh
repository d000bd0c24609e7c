#!/usr/bin/env bash
# Regenerates docs/results/claim3_offpolicy (docs/reproduce.md): its runs on seeds 0-2 and the report.
exec "$(dirname "$0")/../claims.sh" claim3_offpolicy
