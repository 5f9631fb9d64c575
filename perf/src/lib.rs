//! Client tools for uturn (turncat, turnperf).
