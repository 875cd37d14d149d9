"""What every backend's engine process shares: the outbox it writes to the front end, and
how a control's outcome becomes its reply."""
