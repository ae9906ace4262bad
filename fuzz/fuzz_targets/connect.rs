//! Fuzz the connect/accept hand-shake of endpoints: its message decoder and one endpoint's machine under arbitrary operations and messages (`clan_wire::fuzzing::connect`).
//! Run: `cargo fuzz run connect` (seed corpus: `fuzz/corpus/connect`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| clan_wire::fuzzing::connect(data));
