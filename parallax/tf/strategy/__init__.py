"""The strategy and what puts a plan into effect: `parallax_strategy.py` (`ParallaxStrategy`,
a `tf.distribute.Strategy`, and its extended hooks), `config.py` (`StrategyConfig`, the
user's options, which build the plan's `PlacementOptions`), `binding.py` (check that every
worker made the same plan, create and fill the tables, bind each variable to its table) and
`datasets.py` (each worker's part of the data)."""
