//! jetrunner reconciler service
