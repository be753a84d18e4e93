#!/bin/bash
sed -i 's/return a + b + 1/return a + b/' /app/calc.py
