"""The prefix store: prompt blocks named by a chained hash (`keys`, shared with the handler side),
their tree with pins and LRU order (`index`), what a block holds in RAM (`data`), the store that
keeps and fetches them (`store`), where snapshots of uncuttable state are taken (`snapshots`), and
the disk tier behind RAM (`disk_link` on the engine thread, `disk_tier` with its writer and loader
threads). Engine thread only, but for `keys`, `index` and `snapshots`, which are pure."""
