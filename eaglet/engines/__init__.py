"""Generation engines. `eaglet.engines.registry` lists them and makes the one the config names
(`make_engine`); `base` says what an engine is; `http` is what the server engines share."""
