"""Framework integrations: sandkernel sessions as other agent frameworks' sandboxes and tools."""
