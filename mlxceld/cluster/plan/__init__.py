"""Pipeline plans: the plan as values (``model``), the solver that splits the layers
(``solver``), plans from what discovery knows (``candidates``), and a plan shown to a
person or a program (``report``). Pure, apart from reading checkpoint headers."""
