"""CPU tests of optimizer_state/: plan, offloader, chunked and streamed step, scheduler."""
