//! JetStream bus: streams and consumers declared in code, dedupe and once-only publish, consumer loop
