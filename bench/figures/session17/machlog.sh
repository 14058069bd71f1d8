#!/bin/bash
# every 5 s: time, vmstat's us sy id wa st, and the CPUs' MHz
while true; do
  v=$(vmstat 1 2 | tail -1 | awk '{print $13, $14, $15, $16, $17}')
  mhz=$(grep MHz /proc/cpuinfo | awk '{printf "%s ", $4}')
  echo "$(date -u +%H:%M:%S) $v $mhz"
  sleep 4
done
