"""Pipeline-parallel training: where to cut, the stages and their compressed boundaries, the one-process and distributed runners, and the step-time prediction."""
