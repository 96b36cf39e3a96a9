"""Mixture-of-experts policies: finding a model's routers, capturing the experts they pick, replaying a
recorded routing in training (R2/R3), and the routing's metrics and storage form."""
