"""Messages between ranks: collectives, the wire protocol, packing and waiting."""
