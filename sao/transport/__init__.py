"""Kafka transport: the embedded broker, topic setup, client factories, the dead-letter queue and
the policy topic's announcements. Import from the modules themselves (`sao.transport.kafka`, ...)."""
