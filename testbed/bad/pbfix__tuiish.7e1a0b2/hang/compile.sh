#!/bin/sh
# Builds ./executable offline from the submission root.
set -e
gcc -O2 -o executable main.c
