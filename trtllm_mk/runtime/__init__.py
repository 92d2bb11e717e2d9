"""Runtime: the megakernel host side (launch, buffers, torch op) and the hybrid engine."""
