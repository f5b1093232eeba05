//! Page contents the bench can check: every 8-byte word is a function of the
//! page's GPA, a seed, and the word's index.

use rdma_transport::{Page, PAGE_SIZE};

const WORDS: usize = PAGE_SIZE / 8;

fn word(gpa: u64, seed: u64, i: usize) -> u64 {
    (gpa ^ seed.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// Fills `page` with the pattern of (`gpa`, `seed`).
pub fn fill(page: &mut Page, gpa: u64, seed: u64) {
    for (i, chunk) in page.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(gpa, seed, i).to_le_bytes());
    }
}

/// True when `page` holds the pattern of (`gpa`, `seed`).
pub fn check(page: &Page, gpa: u64, seed: u64) -> bool {
    let mut diff = 0u64;
    for (i, chunk) in page.chunks_exact(8).enumerate().take(WORDS) {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        diff |= u64::from_le_bytes(w) ^ word(gpa, seed, i);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_and_detect_changes() {
        let mut page = [0u8; PAGE_SIZE];
        fill(&mut page, 0x5000, 7);
        assert!(check(&page, 0x5000, 7));
        assert!(!check(&page, 0x6000, 7), "another GPA");
        assert!(!check(&page, 0x5000, 8), "another seed");
        page[4095] ^= 1;
        assert!(!check(&page, 0x5000, 7), "one flipped bit");
    }
}
