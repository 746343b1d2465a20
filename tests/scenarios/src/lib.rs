//! Cross-service scenario harness, chaos suite, benchmark and demo
