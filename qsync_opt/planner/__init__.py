"""The solve pipeline over the solvers: modes, refinement, the joint batch split and its bounds, diagnosis, dominance, the Pareto sweep and plan figures."""
