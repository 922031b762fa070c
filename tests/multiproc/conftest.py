import os
import sys

# tests/: harness and the doubles, imported by name
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
