#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| holdfast_fuzz::policy_file(data));
