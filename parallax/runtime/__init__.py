"""What every process parallax starts runs with, servers and workers alike: its log format
and level, the lifeline that ends it with its parent, and its allocator tuning."""
