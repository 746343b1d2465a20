//! Configuration: one TOML file for all services, environment overrides, strict validation
