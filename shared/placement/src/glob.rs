//! The one pattern language of placement matchers: `*` matches any run of characters (also
//! none, also `/`); every other character matches itself, ASCII case-insensitively, because the
//! forge treats owner and repository names case-insensitively and a matcher that misses by case
//! would silently stop protecting or restricting.

/// Whether `text` matches `pattern`. Runs in O(len(pattern) · len(text)) at worst, without
/// recursion, so hostile patterns or names cannot blow the stack.
pub(crate) fn glob_matches(pattern: &str, text: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let text: Vec<char> = text.chars().collect();
    let (mut p, mut t) = (0, 0);
    // The pattern position just after the last `*` seen, and the text position it resumes from.
    let mut resume: Option<(usize, usize)> = None;
    while let Some(&c) = text.get(t) {
        match pattern.get(p) {
            Some('*') => {
                p += 1;
                resume = Some((p, t));
            }
            Some(&q) if q.eq_ignore_ascii_case(&c) => {
                p += 1;
                t += 1;
            }
            _ => match resume {
                // Let the last `*` swallow one more character and retry from there.
                Some((after_star, from)) => {
                    p = after_star;
                    t = from + 1;
                    resume = Some((after_star, from + 1));
                }
                None => return false,
            },
        }
    }
    pattern
        .get(p..)
        .is_some_and(|rest| rest.iter().all(|&c| c == '*'))
}

#[cfg(test)]
mod tests {
    use super::glob_matches;
    use proptest::prelude::*;

    /// A slow, obviously correct matcher to compare against.
    fn reference(pattern: &[char], text: &[char]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some(('*', rest)) => (0..=text.len()).any(|skip| reference(rest, &text[skip..])),
            Some((c, rest)) => text.split_first().is_some_and(|(t, text_rest)| {
                c.eq_ignore_ascii_case(t) && reference(rest, text_rest)
            }),
        }
    }

    #[test]
    fn star_matches_any_run_including_slashes_and_nothing() {
        assert!(glob_matches("acme/*", "acme/web"));
        assert!(glob_matches("acme/*", "acme/"));
        assert!(glob_matches("*", ""));
        assert!(glob_matches("*/*-infra", "acme/prod-infra"));
        assert!(glob_matches("a*b*c", "a/x/b/y/c"));
        assert!(!glob_matches("acme/*", "acme"));
        assert!(!glob_matches("acme/*", "other/web"));
    }

    #[test]
    fn literals_match_whole_text_ignoring_ascii_case() {
        assert!(glob_matches("Acme/Web", "acme/web"));
        assert!(!glob_matches("acme/web", "acme/web2"));
        assert!(!glob_matches("acme/web", "xacme/web"));
        assert!(!glob_matches("", "x"));
        assert!(glob_matches("", ""));
    }

    proptest! {
        #[test]
        fn agrees_with_the_reference_matcher(pattern in "[ab*/A]{0,8}", text in "[abB/]{0,10}") {
            let p: Vec<char> = pattern.chars().collect();
            let t: Vec<char> = text.chars().collect();
            prop_assert_eq!(glob_matches(&pattern, &text), reference(&p, &t));
        }

        #[test]
        fn never_panics_on_any_unicode(pattern in "\\PC{0,12}", text in "\\PC{0,12}") {
            let _ = glob_matches(&pattern, &text);
        }
    }
}
