"""The engine core: the loop, its scheduler, executor and runner, requests and the step contract."""
