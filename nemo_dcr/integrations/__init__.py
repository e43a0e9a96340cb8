"""The edge to training and inference frameworks (they are imported only here, and lazily)."""
