"""The integer program's data (AllocationProblem), the evaluator, plans and their check, synthetic instances."""
