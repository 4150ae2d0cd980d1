#!/bin/bash
cp calculator.sh executable
chmod +x executable
