"""The LocalService: the store inside an inference process, and the memory it adds to the pool."""
