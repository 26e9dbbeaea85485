"""The main job: sweep compressed variants, measure quality against cost, find the Pareto frontier, recommend one
under a budget; per-layer sensitivity and mixed precision; capacity planning."""
