#!/bin/sh
# Builds ./executable offline from the submission root.
set -e
gcc -O2 -Wall -o executable main.c
