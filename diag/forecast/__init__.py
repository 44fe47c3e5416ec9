"""What the job costs and will cost: the cost table every figure is read from, the budget."""
