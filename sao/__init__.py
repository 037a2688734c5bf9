"""sao: asynchronous single-trajectory RL post-training through Kafka."""
