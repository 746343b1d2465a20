//! jetrunner scheduler service
