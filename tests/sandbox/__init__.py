"""The sandbox: extraction, the wire format, check splitting, scoring through real sandboxes, attacks."""
