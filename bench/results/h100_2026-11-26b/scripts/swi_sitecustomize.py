# scratch experiment (not committed): hand the GIL over after 0.5 ms instead of 5 ms
import sys
sys.setswitchinterval(0.0005)
