//! jetrunner vm-worker service
