//! Fuzz descriptors: the binary and text decoders (a descriptor that decodes encodes back to
//! the same value, both ways) and narrowing (never a panic, never wider than its parent).
//! Run: `cargo fuzz run descriptor` (seed corpus: `fuzz/corpus/descriptor`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| clan::fuzzing::descriptor(data));
