"""What the tests share (harnesses, checks, fixtures' machinery): no test module imports another."""
