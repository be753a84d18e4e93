#!/bin/bash
sed -i 's#-C /app/dta #-C /app/data #' /app/backup.sh
chmod +x /app/backup.sh
/app/backup.sh
