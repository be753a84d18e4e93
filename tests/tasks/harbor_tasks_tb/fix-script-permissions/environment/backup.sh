#!/bin/bash
# Archives /app/data into /app/backups/data.tar.gz
set -euo pipefail
mkdir -p /app/backups
tar -czf /app/backups/data.tar.gz -C /app/dta .
echo "backup written"
