"""Start, watch and stop engine cores: one interface, an `mp` and (later) a `ray` implementation."""
