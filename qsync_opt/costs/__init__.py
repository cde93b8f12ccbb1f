"""What an op costs: the device catalog, clusters, the roofline estimate, the batch model, the CostTable algebra and the cost-and-memory rules."""
