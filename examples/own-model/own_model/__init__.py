"""own-model: a Flower app that trains its own GRU language model with fl-geo."""
