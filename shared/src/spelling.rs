//! The nearest of some known words to a misspelled one, for errors and warnings that name the
//! fix ("did you mean `protocol`?").

/// The known word closest to `word` (case-insensitive edit distance), if it is close enough
/// to be a likely misspelling: at most a third of the longer word's letters apart, and at
/// most 3. The first of equally close words wins.
pub(crate) fn nearest<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let word = word.to_ascii_lowercase();
    known
        .into_iter()
        .map(|candidate| (distance(&word, &candidate.to_ascii_lowercase()), candidate))
        .filter(|(d, candidate)| *d <= 3 && *d * 3 <= word.len().max(candidate.len()))
        .min_by_key(|(d, _)| *d)
        .map(|(_, candidate)| candidate)
}

/// The Levenshtein distance between `a` and `b` over their characters, with a swap of two
/// neighbours counting once (optimal string alignment): `protcol` is 1 from `protocol`,
/// `adress` 1 from `address`, `rpotocol` 1 from `protocol`.
fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // Three rows of the table: two back (for swaps), one back, and the one being filled.
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    let mut current = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        current[0] = i;
        for j in 1..=b.len() {
            let substitution = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (previous[j] + 1)
                .min(current[j - 1] + 1)
                .min(previous[j - 1] + substitution);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(before[j - 2] + 1);
            }
            current[j] = best;
        }
        std::mem::swap(&mut before, &mut previous);
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_counts_edits_and_swaps() {
        for (a, b, d) in [
            ("", "", 0),
            ("protocol", "protocol", 0),
            ("protcol", "protocol", 1),
            ("adress", "address", 1),
            ("rpotocol", "protocol", 1),
            ("infoo", "info", 1),
            ("kitten", "sitting", 3),
            ("", "abc", 3),
        ] {
            assert_eq!(distance(a, b), d, "{a} ~ {b}");
            assert_eq!(distance(b, a), d, "{b} ~ {a}");
        }
    }

    #[test]
    fn nearest_names_a_likely_misspelling_only() {
        let known = ["name", "protocol", "address", "port", "routes"];
        assert_eq!(nearest("protcol", known), Some("protocol"));
        assert_eq!(nearest("Adress", known), Some("address"));
        assert_eq!(nearest("prot", known), Some("port"));
        assert_eq!(nearest("route", known), Some("routes"));
        assert_eq!(nearest("endpoints", known), None);
        assert_eq!(nearest("x", known), None);
    }
}
