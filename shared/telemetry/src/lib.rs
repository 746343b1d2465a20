//! Tracing, OTLP export, metrics endpoint, shutdown signal and named tasks
