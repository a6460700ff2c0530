"""kvcheck's benchmarks (make bench): python -m bench."""
