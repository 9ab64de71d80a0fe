//! The small-order key list against the curve itself (curve25519-dalek, for tests only).

use curve25519_dalek::constants::EIGHT_TORSION;
use curve25519_dalek::montgomery::MontgomeryPoint;
use orca_push_host_proof::{is_small_order, public_key};

/// Every listed key, with bit 255 set or not, makes an all-zero shared secret; every torsion
/// point's key is listed; ordinary keys are not.
#[test]
fn the_small_order_keys_are_exactly_those_that_make_an_all_zero_secret() {
    let secret = [0x5a; 32];
    let mut listed = 0;
    for first in 0..=255u8 {
        for last in [0x00, 0x57, 0x7f, 0x80, 0xb8, 0xff] {
            // Scan the shapes the list holds: one varying byte at each end, the middle as in
            // the listed keys (all 0x00 or all 0xff), plus the two order-8 points below.
            for middle in [0x00, 0xff] {
                let mut key = [middle; 32];
                key[0] = first;
                key[31] = last;
                let zero = MontgomeryPoint(key).mul_clamped(secret).to_bytes() == [0; 32];
                assert_eq!(is_small_order(&key), zero, "{key:02x?}");
                listed += usize::from(zero);
            }
        }
    }
    assert!(listed > 0);
    for point in EIGHT_TORSION {
        let key = point.to_montgomery().to_bytes();
        assert!(is_small_order(&key), "{key:02x?}");
        let mut high = key;
        high[31] |= 0x80;
        assert!(is_small_order(&high), "{high:02x?}");
        assert_eq!(MontgomeryPoint(key).mul_clamped(secret).to_bytes(), [0; 32]);
    }
    for seed in 1..=64u8 {
        let key = public_key(&[seed; 32]);
        assert!(!is_small_order(&key));
    }
}
