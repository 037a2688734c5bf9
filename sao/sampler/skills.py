"""Held-out success by skill: each env-tagged skill's figures per version, and the format-only ceiling.

An env may tag a task with the skills it exercises (`skills(spec)`: arithmetic tags `answer<0` or
`answer>=0`). The *headline* skill is the tag on which the base model does worst: what training must
teach beyond the reply's form. The *format-only ceiling* is the share of judged tasks without that
skill: the success of a model that gets every other task right and none of the skill's, which is
the most that fixing the reply's form can reach when the base model cannot do the skill at all.
"""

from __future__ import annotations

from collections.abc import Iterable

from sao.envs.registry import task_skills
from sao.schema import Task
from sao.stats import mean, paired_gain, stderr

# task id -> the skills it exercises, sorted
SkillTags = dict[str, list[str]]


def tag_tasks(env_name: str, tasks: Iterable[Task]) -> SkillTags:
    """Each task's skills, as env `env_name` tags them (none where the env defines no `skills`)."""
    skills = task_skills(env_name)
    return {task.task_id: sorted(skills(task.spec)) for task in tasks}


def headline_skill(tags: SkillTags, base: dict[str, float]) -> str | None:
    """The skill on which the base model's success over the tasks it tags is lowest (ties: more tasks, then the
    name); None when no judged task has a skill."""
    rates: dict[str, list[float]] = {}
    for task_id, success in base.items():
        for skill in tags.get(task_id, ()):
            rates.setdefault(skill, []).append(success)
    if not rates:
        return None
    return min(rates, key=lambda skill: (mean(rates[skill]), -len(rates[skill]), skill))


def format_ceiling(tags: SkillTags, skill: str | None, task_ids: list[str]) -> float | None:
    """Share of `task_ids` not tagged with `skill`: the score of every other task right and every one of it wrong."""
    if skill is None or not task_ids:
        return None
    return mean([float(skill not in tags.get(t, ())) for t in task_ids])


def breakdown(tags: SkillTags, versions: dict[str, dict[str, float]], base: str = "base") -> dict[str, dict]:
    """Per skill: n, and each version's success with its s.e. (`<name>`, `<name>_stderr`); every version but
    `base` also its paired gain over `base` (`<name>_gain`, `<name>_gain_stderr`). `versions` maps a name to
    per-task success on the same tasks."""
    task_ids = list(versions[base])
    skills = sorted({skill for t in task_ids for skill in tags.get(t, ())})
    figures: dict[str, dict] = {}
    for skill in skills:
        tagged = [t for t in task_ids if skill in tags.get(t, ())]
        row: dict = {"n": len(tagged)}
        for name, scores in versions.items():
            values = [scores[t] for t in tagged]
            row[name], row[f"{name}_stderr"] = mean(values), stderr(values)
            if name != base:
                row[f"{name}_gain"], row[f"{name}_gain_stderr"] = paired_gain([versions[base][t] for t in tagged],
                                                                              values)
        figures[skill] = row
    return figures


def skill_figures(tags: SkillTags, versions: dict[str, dict[str, float]], base: str = "base") -> dict:
    """What heldout.json and the summary carry: `heldout_skills` (the whole breakdown), the headline skill's
    figures flat (`heldout_skill_<version>...`) and the format-only ceiling on the same tasks."""
    figures = breakdown(tags, versions, base)
    skill = headline_skill(tags, versions[base])
    flat: dict = {"heldout_skill": skill, "heldout_skills": figures,
                  "heldout_format_ceiling": format_ceiling(tags, skill, list(versions[base]))}
    for key, value in (figures.get(skill) or {}).items():
        flat[f"heldout_skill_{key}"] = value
    return flat
